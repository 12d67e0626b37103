"""The project's kernels (the CPU's, and the GPU's decode attention) and the plan of which serves
where, chosen per machine when a model is loaded.

    machine.py            the CPU's flags and caches, how busy other processes are, timing a call
    extension.py          builds and loads the C++ kernels of csrc/ on first use
    gemv.py               the project's GEMV for one or two rows, float and int8 (csrc/gemv.cpp, int8_gemv.cpp)
    decode_attention.py   a decode step's attention over the slot cache (csrc/decode_attention.cpp on a
                          CPU, triton_decode.py on a GPU), and whether it pays in bfloat16 here
    triton_decode.py      that attention as a Triton kernel, for CUDA
    norms.py              a GPU's layer norms adding the residual stream in their own pass (`fuse_layer_norms`)
    triton_norm.py        that add and layer norm as a Triton kernel, for CUDA
    epilogue.py           a GPU's linear layers applying their GELU or ReLU in cuBLASLt's epilogue
    few_rows.py           a GPU's linear layers at a few rows through triton_gemv.py where, timed, it beats cuBLAS,
                          and those a layer norm feeds normalizing their rows as they read them (`fuse_norm_linears`)
    triton_gemv.py        that matmul of a few rows (bias and activation in its pass, or the norm before it)
                          as a Triton kernel
    matmuls.py            every kernel that computes a linear layer, and a Plan of which serves which rows
    ops.py                packed layers as ops of compiled graphs (nanoserve::linear, nanoserve::int8_linear)
    linear.py             KernelLinear: an nn.Linear with its weight packed for its plan
    quantize.py           int8: every nn.Linear swapped for an Int8Linear at load
    planner.py            choosing each layer's plan by timing (`pack_linears`), and what it chose

A model's layers import none of this: loading swaps their nn.Linear modules for these (planner.py
`pack_linears`, quantize.py `quantize_int8`; on a GPU few_rows.py `fuse_few_rows`), and
nanogpt/layers.py `project` lets a swapped layer compute an activation or a residual in its own
pass (their `fused`); on a GPU its nn.LayerNorm modules (norms.py `fuse_layer_norms`), which
`add_norm` lets add in their own pass, and `norm_project` lets a norm-fed layer normalize in its own.
"""
