"""A host-shaped fake of Miles (radixark/miles), importable as `miles`, for mrlx_plugin's tests.

Miles cannot be installed here (it needs Megatron, SGLang, Ray and a GPU). This package keeps
Miles' module layout for the parts a rollout plugin meets: the Sample, the generate and rollout
function interfaces and their loaders, the class-based, legacy (v1) and fully-async rollouts, the
rollout manager's post-processing, reward normalisation, data-parallel split and metric logging,
and argument parsing. Each module is a small re-statement of the behaviour and invariants the
plugin depends on, written from reading Miles (2026-08); nothing is copied. No Ray, no object
store, no router: the rollout manager is a plain object, and the "router" address is one engine.

`tests/hosts/miles/train.py` drives it like Miles' `train.py`.
"""
