"""Compiled forwards (``--compile``): fixed-shape steps, AOT packages, CUDA graphs.

The fixed-shape forward (``fixed_step``) over a fixed-shape KV view
(``fixed_kv``), the graphs of one step module (``fixed_graphs``), AOTInductor
packages kept on disk (``aot``), CUDA graphs over them (``cuda_graphs``), the
compiled target forward (``forwards``), batched compiled verification
(``batched``) and the start-up decision whether a model runs compiled
(``startup``).

May import: torch, ``specdec.model``, ``specdec.request``. Never a service or gRPC.
"""
