"""The supervisor's part in the KV tiers (DESIGN.md "KV tiers").

* :mod:`.files`: where a model's tiers live and what they hold on disk,
  without running an engine: tier settings from a preset, the stop budget
  that leaves a save its time, the disk tier's folders (use, clear), a
  ``cmd`` llama-server's slot files, the tenant secret.
* :mod:`.cache`: :class:`~.cache.KvCache`, the jobs around them while the
  server runs: ``cache`` state lines, disk scans, slot save and restore,
  ``cache clear``.
"""
