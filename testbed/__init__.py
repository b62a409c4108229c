"""The testbed: tiny trained targets (Llama, MoE, MLA, long-context) and their corpora, built on CPU in minutes
by ``fledge tiny-target`` for the tiny recipes and the test suite."""
