"""Data files shipped with asyncrl: ``tiny_corpus.txt`` trains the tiny test tokenizer.

``tiny_corpus.txt`` is English prose, arithmetic problems with answers and ChatML-formatted
turns, generated once with a fixed seed; :func:`asyncrl.models.build_tiny_model` trains a small
byte-level BPE tokenizer on it so that digits, operators and the chat markers tokenize sensibly.
"""
