"""What serving a model needs beside the model: the slot KV cache and the windows through which a
batch attends over it (kv_cache.py), the precision a model runs in on this hardware and the cache's
dtype (precision.py), the compiled decode step (compile.py) and its on-disk cache
(compile_cache.py), and the decode step replayed from CUDA graphs (cuda_graphs.py)."""
