"""The OpenAI API: the request schema, one blueprint per resource (completions, models, jobs), the
queue and the event streams behind them, and the error envelope."""
