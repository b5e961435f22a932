"""cptune's schema migrations (Alembic), installed as ``cptune.db`` so a regular install
can apply them. Applied automatically when a store is opened."""
