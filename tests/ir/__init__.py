"""Tests of attncc.ir: analysis, simplification, bounds, tiles, hoisting."""
