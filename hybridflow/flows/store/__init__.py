"""The SQL run store (SQLAlchemy, Alembic migrations): runs, metrics, checkpoints, placements, plans."""
