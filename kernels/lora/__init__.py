"""LoRA's segmented gather matmul (SGMV): reference and dispatch beside the Triton kernel."""
