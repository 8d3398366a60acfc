"""Run torchtitan's stock configs on the CPU (no GPU, torch 2.13), e.g. the README's command.

``PYTHONPATH=<shardscale>/tests/titan_cpu TITAN_CPU=1 torchrun ... -m torchtitan.train ...`` (from a folder
with torchtitan's ``tests/assets``), with ``--parallelism.spmd_backend partial_dtensor`` for
torch 2.13. Python imports this file at start-up; with ``TITAN_CPU`` set it installs
``tests/_titan.py``'s CPU scaffolding and, for the stock llama3 configs, SDPA attention
(FlexAttention has no CPU backward) and SUM reductions in FSDP2 (gloo has no PREMUL_SUM).
Test tooling only: shardscale's integration needs none of it.
"""

import os
import sys

if os.environ.get("TITAN_CPU"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _titan

    _titan.install_cpu_scaffolding()
    import torchtitan.models.llama3 as llama3
    import torchtitan.models.llama3.parallelize as parallelize
    from torchtitan.models.common.attention import ScaledDotProductAttention

    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    parallelize.parallelize_llama = _titan._sum_reductions(parallelize.parallelize_llama)
    llama3.parallelize_llama = parallelize.parallelize_llama
