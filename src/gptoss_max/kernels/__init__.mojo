# gpt-oss kernels for MAX: MXFP4 / BF16 mixture-of-experts, the router's top-k, sink attention.
# One registered op per file; shared device functions live in mxfp4.mojo and
# moe_common.mojo. Op names carry a `gptoss_` prefix (MAX's registry is global).
