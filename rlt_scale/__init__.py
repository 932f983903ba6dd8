"""rlt-scale: pretraining the Recurrent Looped Transformer at scale."""

import warnings

# megatron-core warns on import that optional CUDA fusion libraries are absent;
# rlt-scale never uses them, so the warning is noise in every command's output.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
