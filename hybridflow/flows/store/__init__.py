"""The SQL run store (SQLAlchemy, Alembic migrations): runs, metrics, checkpoints, placements, plans. It imports
nothing of HybridFlow (`tests/test_layering.py`); `run_store.RunStore` is its entry point."""
