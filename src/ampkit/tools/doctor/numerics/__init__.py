"""The numerics doctor: the range census, the overflow localizer, lost updates, accumulation checks, findings and
report."""
