"""A training job's running upkeep, apart from what it learns: the run log and the experiment trackers that record
it, the stop on a signal or a failed step that saves what is done, and the time budget that ends it."""
