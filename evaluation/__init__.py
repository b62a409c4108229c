"""Measuring a drafter: the speculative-decoding harness, attention drift, the eval stage's work, acceptance vs
context length, the engine in the loop, the report, EAGLE-3.1 vs EAGLE-3 comparison, and the named eval sets."""
