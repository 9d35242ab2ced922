"""Structured output for the built-in instance: GBNF checks (:mod:`.gbnf`),
JSON schemas (:mod:`.json_grammar`) and regular-expression patterns
(:mod:`.pattern_grammar`) to GBNF over shared rule helpers
(:mod:`.gbnf_rules`), and a request's ``grammar`` / ``json_schema`` /
``response_format`` / forced tool turned into one grammar
(:mod:`.structured`).
"""
