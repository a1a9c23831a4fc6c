"""Use a model: open what training left behind (`load`), generate and chat (`generate`, `chat`), evaluate
(`evaluate`) and export a checkpoint (`export_command`). Sits at the train level: it imports train, models and
data; only cli and bench sit above it."""
