# Alembic revisions of the knowledge domain (a package only so that installs ship them).
