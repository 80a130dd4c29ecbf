"""Published hardware and model figures the GPU scenarios are built from (sources in each docstring; docs/scaling.md)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Hardware", "H100", "A100", "IB_NDR_PORT_BYTES_PER_S", "ModelShape", "QWEN25_7B", "LLAMA31_8B",
           "SGLANG_A100_LLAMA8B", "DEEPSPEED_SUSTAINED_MFU"]


@dataclass(frozen=True)
class Hardware:
    """One accelerator's published peak figures.

    Attributes:
        name: the part.
        hbm_bytes: GPU memory, bytes.
        hbm_bytes_per_s: peak memory bandwidth, bytes/s.
        bf16_flops: dense BF16 tensor-core peak, FLOP/s.
        source: where the numbers come from.
    """

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    source: str


H100 = Hardware(
    "H100 SXM", 80e9, 3.35e12, 989e12,
    "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 80 GB HBM3, 3.35 TB/s, BF16 Tensor Core "
    "1,979 TFLOPS with sparsity = 989 TFLOPS dense, NVLink 900 GB/s "
    "(https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet)")
A100 = Hardware(
    "A100 80GB SXM", 80e9, 2.039e12, 312e12,
    "NVIDIA A100 datasheet, A100 80GB SXM: 2,039 GB/s HBM2e, BF16 Tensor Core 312 TFLOPS dense "
    "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)")

#: One InfiniBand NDR port, bytes/s (400 Gb/s). A DGX H100 has eight single-port ConnectX-7
#: adapters "up to 400 Gb/s InfiniBand/Ethernet" (NVIDIA DGX BasePOD reference architecture,
#: https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/core-components.html).
IB_NDR_PORT_BYTES_PER_S = 400e9 / 8


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's size, from its Hugging Face ``config.json``.

    Attributes:
        name: the model.
        params: all parameters.
        embedding_params: input-embedding parameters (no FLOPs; the LM head is counted in N).
        n_layer, d_model: layers and hidden size (attention FLOPs, eq. 2).
        kv_heads, head_dim: for the KV cache: ``2 * n_layer * kv_heads * head_dim * 2`` bytes
            per token in BF16.
        source: where the shape comes from.
    """

    name: str
    params: float
    embedding_params: float
    n_layer: int
    d_model: int
    kv_heads: int
    head_dim: int
    source: str

    @property
    def compute_params(self) -> float:
        """N of eq. (2): parameters that cost 2 FLOPs per token forward (all but the embedding)."""
        return self.params - self.embedding_params

    @property
    def weight_bytes(self) -> float:
        """BF16 weights, bytes."""
        return 2.0 * self.params

    @property
    def kv_bytes_per_token(self) -> float:
        """BF16 K and V of one token over all layers, bytes."""
        return 2.0 * self.n_layer * self.kv_heads * self.head_dim * 2.0

    def train_flops(self, seq_tokens: float) -> float:
        """Forward + backward FLOPs of one sequence of ``seq_tokens`` tokens, eq. (2)."""
        return 6.0 * self.compute_params * seq_tokens + 3.0 * self.n_layer * self.d_model * seq_tokens ** 2


QWEN25_7B = ModelShape(
    "Qwen2.5-7B", 7.62e9, 152064 * 3584, 28, 3584, 4, 128,
    "Qwen/Qwen2.5-7B config.json: 28 layers, hidden 3584, 28 heads, 4 KV heads (head dim 128), "
    "intermediate 18944, vocab 152064, untied LM head: 7.62B parameters (the model card rounds to 7.61B)")
LLAMA31_8B = ModelShape(
    "Llama-3.1-8B", 8.03e9, 128256 * 4096, 32, 4096, 8, 128,
    "meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 8 KV heads (head dim 128), "
    "vocab 128256; 8.03B parameters")

#: SGLang v0.3.0, Llama-3.1-8B-Instruct on 1 x A100 80G, ShareGPT at 4 requests/s: median
#: inter-token latency 11.93 ms (median TPOT 13.17 ms, median E2E latency 1,564 ms); offline
#: 5,000 prompts: 4,281.51 output tok/s (sgl-project/sglang benchmark/benchmark_vllm_060/README.md).
SGLANG_A100_LLAMA8B = {"itl_s": 11.93e-3, "e2e_s": 1.56417, "rps": 4.0, "offline_tok_s": 4281.51}

#: DeepSpeed-Ulysses: "sustained throughput of over 175 TFlops/GPU (over 54% of hardware peak)"
#: on A100 (Jacobs et al., arXiv:2309.14509; microsoft/DeepSpeed blogs/deepspeed-ulysses).
DEEPSPEED_SUSTAINED_MFU = 0.54
