"""What graphswap knows of Hugging Face decoder models: checkpoints and configs
(:mod:`~graphswap.hf.checkpoints`), the decoder stack and its classes
(:mod:`~graphswap.hf.decoder`), attention kernels and what each saves
(:mod:`~graphswap.hf.attention_kernels`), and named model sizes
(:mod:`~graphswap.hf.presets`). Importing it loads no model code.
"""

from graphswap._compat import module_getattr

__getattr__ = module_getattr(__name__)  # 0.1.0 names that moved, until 0.3
