"""Custom ops (`torch.ops.hybridtune.*`) and their pure-torch references.

`import hybridtune.mixers.gdn.ops` registers `hybridtune::causal_conv1d`, `hybridtune::gdn_chunk` and their
backward ops. This package imports nothing else of hybridtune.
"""
