"""HTTP routes and middleware; the only place Starlette is used."""
