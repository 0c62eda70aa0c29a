"""The job's config (`job.py`: `Config`, its own sections and `load_config`, over the sections of models, parallel,
data and optim) and the commands that read configs alone (`cli.py`: `hlat config fields`, `hlat describe`). The typed
field machinery they are built on sits below every section: `hlat.fields`."""
