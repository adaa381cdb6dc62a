"""One Prefect task per stage of an iteration (and checkpoint, validate, reward-model steps): each a thin call of one
worker-group method on data handles."""
