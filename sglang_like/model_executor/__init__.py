"""What runs a model's forwards beside the ModelRunner: CUDA graphs of the decode step."""
