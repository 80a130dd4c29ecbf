"""The embedded engine on a CUDA GPU (``--device cuda``): the engine tests of
tests/test_rollout_engine.py that need no second process group, with the servers on the GPU and
the references (greedy decoding, trainer-style logprob recomputation) on the CPU in fp32.

Marked ``gpu``: skipped without CUDA; ``bench/gpu_check.sh`` runs them (stage ``gpu_tests``).
On a CPU-only machine the CPU side of the same code path is covered by tests/test_rollout_engine.py
(the engine runs where its model is; on CPU every tensor it makes stays on the CPU).
"""

from __future__ import annotations

import pytest

from tests.test_rollout_engine import (  # noqa: F401  (collected here, with its fixtures and this module's engine_args)
    dirs,
    models,
    srv_a,
    srv_b,
    srv_w,
    test_behaviour_logprobs_match_trainer_recomputation,
    test_greedy_matches_full_recomputation,
    test_prompt_and_top_logprobs,
    test_sampling_filters_and_penalties,
    test_sampling_seed_is_reproducible,
    test_token_identity_segmented_across_servers,
    test_weight_update_in_place_tags_token_spans,
    test_weight_update_mid_generation_abort_mode,
)


def _no_cuda() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a dependency
        return True


pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.skipif(_no_cuda(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def engine_args():
    """Every server of the imported tests runs on the GPU; the references stay on the CPU in fp32."""
    return ("--device", "cuda")


async def test_the_engine_reports_it_runs_on_cuda(srv_a):
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(srv_a.url + "/server_info") as r:
        info = await r.json()
    assert info["device"].startswith("cuda") and info["dtype"] == "float32"
