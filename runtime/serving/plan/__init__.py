"""Serving plans: the packed format, batch argument checks, LPT, the scheduler and the C
planner (format <- lpt, format <- planner, all <- scheduler)."""
