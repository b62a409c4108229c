"""Drafter layer kinds (an extension point): the kind record, its registry and the built-in kinds."""
