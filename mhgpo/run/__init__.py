"""Runs as a whole: the composition root (settle a config, build a job), run folders, resuming, evaluation, reports."""
