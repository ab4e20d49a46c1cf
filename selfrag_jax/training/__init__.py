"""Training of the Self-RAG critic and generator (and the small base models of the demo)."""
