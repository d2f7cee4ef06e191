"""Benchmarks of hybridmoe. Entry points, each with subcommands (`python3 benchmarks/NAME.py --help`):

    kernel.py   one MoE layer's CPU experts, their trace and call cost, the GPU's expert and GEMV kernels,
                the CPU/GPU handoff, and the C++ micro-benchmarks of the decode kernels
    decode.py   a decode step: its GPU kernels, its parts outside the layers, its CPU calls traced, deferral
    prefill.py  a prefill step per layer, and experts streamed over PCIe against the CPU
    e2e.py      end-to-end speed against the decode floor, the issue's suites
    quality.py  accuracy of the expert formats, of deferral, of the route prediction
    load.py     peak RSS and time of a load
    serve.py    a running server under concurrency, and a soak run
    context.py  decode and prefix reuse at long contexts, the context a budget holds, the fp8 cache's accuracy
    structured.py  decode held to a JSON schema against free decode, and a large schema's compile time
    peers.py    llama.cpp and kt-kernel built and run beside us (docs/benchmarks.md)
    finetune.py LoRA fine-tuning: hybridmoe against accelerate's expert offload and the all-GPU model

The subcommands' code lives in lib/ (the C++ micro-benchmarks' sources in native/); each prints a table
and writes JSON with --json, its baseline measured in the same run. The entry points' names stay clear of
importable packages: run as scripts, this folder is first on sys.path (a `kernels.py` here would hide the
`kernels` package that transformers looks for).
"""
