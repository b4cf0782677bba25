"""The application: the ``graphswap`` command and the trainer behind ``graphswap train``.

Order of a run: :mod:`~graphswap.train.config` reads and checks the settings,
:mod:`~graphswap.train.preflight` refuses what cannot work before anything is built,
:mod:`~graphswap.train.build` builds the model and applies the pass plan (``passes``),
:mod:`~graphswap.train.trainer` runs the steps, :mod:`~graphswap.train.cli` shows them.
:mod:`~graphswap.train.budget` installs the budget mode, in one call, on a model that
``transformers.Trainer`` or TRL's ``SFTTrainer`` trains instead.
Nothing here is imported by the core (``graphswap.planning``, ``graphswap.rewriting``,
``graphswap.runtime``, ``graphswap.hf``); this package stays light to import, so that
``graphswap --help`` does not load torch.
"""

from graphswap._compat import module_getattr

__getattr__ = module_getattr(__name__)  # 0.1.0 names that moved, until 0.3
