"""Tests of attncc.runtime.serving.plan: plan format, LPT, scheduler, the C planner."""
