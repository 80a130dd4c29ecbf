"""Streaming rollout worker (issue 4 item 3): claims work from the rollout buffer,
streams `/generate` chunks from a rollout server into the buffer, follows the
version clock (pause → load weights → continue), and parks partial samples.

Owner: engineer G. Implementation in progress.
"""
