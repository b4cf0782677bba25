"""Model rewriting: declarative rules (:mod:`~graphswap.rewriting.rules`) matched by
exact type and applied all-or-nothing (:mod:`~graphswap.rewriting.apply`), the record of
what a pass did to a model (:mod:`~graphswap.rewriting.transforms`), and the prefetch
graph (:mod:`~graphswap.rewriting.graph`)."""
