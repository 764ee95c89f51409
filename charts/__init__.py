"""Sources that generate files of the Helm chart in `charts/carpool/` (run `python -m charts.generate`).

The chart itself is plain Helm; this package only holds the typed model of its values, from which
`values.yaml` (with its `# +docs` comments) and `values.schema.json` are written, so the two never drift.
"""
