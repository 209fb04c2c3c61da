"""gpt-oss on Modular MAX: MXFP4 MoE kernels in Mojo and a Harmony-correct Responses API."""

__version__ = "0.1.0"
