"""The reference pages under docs/reference/, generated from the code's declarations: settings (`kvserve.settings`
and each policy's knobs), the command line (the argparse parsers themselves), metrics (the Prometheus registry) and
environment variables (`kvserve.environment`). `python -m kvserve.tools.reference -o docs/reference [--check]`."""
