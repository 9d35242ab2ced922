"""The KV tiers of the built-in instance (issue 29, DESIGN.md "KV tiers"):
a slot's prompt cache, once it is about to be overwritten or dropped, is
kept as its sequence state in host RAM (:mod:`.ram`, ``--cache-ram``) and
spills to disk (:mod:`.disk`, ``--cache-disk``), one file per entry
(:mod:`.entry_file`) under the model's fingerprint (:mod:`.fingerprint`),
with the context checkpoints of a sliding-window or recurrent model
(:mod:`.checkpoint`);
:mod:`.tiers` looks up the longest cached prefix over both. The engine's
side (saving and restoring through llama.cpp) is
:mod:`ggmux.instance.engine.cache_steps`. :mod:`.report` is what the
instance tells of them (``GET /cache``, metrics, the ``cache`` state line),
:mod:`.options` its flags. No llama.cpp here; import the modules themselves
(this package's import loads nothing, so that a tier-less instance loads no
numpy for its report).
"""
