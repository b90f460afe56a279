"""Running a Hugging Face causal LM the way specdec needs it.

Loading local models (``loading``), the causal-LM wrapper with tree and
batched forwards (``causal_lm``), attention (``attention``), attention masks
for every layout (``masks``), the KV cache that commits and rolls back
(``kv``), ALiBi under a tree (``alibi``) and the GGUF export the llama.cpp
peer reads (``gguf_export``).

May import: torch, transformers, ``specdec.request``. Never a service or gRPC.
"""
