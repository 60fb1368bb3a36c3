"""The helpers DeepEP's tests import from ``deep_ep.utils`` (``envs``, ``math``, ``testing``),
with the same names and meaning, written for doorbell (DeepEP's own cannot be imported without
its compiled extension)."""
