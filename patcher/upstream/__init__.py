"""check-upstream and the release matrix: does every patch still match upstream's releases, and
what did each release do when it ran? The modules, from the command down:

- check_upstream_command.py: `patcher check-upstream` (the click command, its options and exit code)
- check.py: check-upstream as a function: index -> downloads -> matrix, gates, nightlies -> report
- check_upstream_render.py: its report on the terminal (rich, stderr) and as Markdown
- index.py: which releases the package index serves, and which wheel carries a release's sources
- wheels.py: the package index through pip only: list releases, download and find a wheel
  (`patcher bundle`'s wheels too), extract its files
- sources.py: one released wheel's files that check-upstream reads, extracted once and cached
- matrix.py: each patch against each release of the distribution it patches (its codemods' verdict)
- gates.py: each edit's declared fact against upstream (the first release where it holds vs its gate)
- facts.py: a Fact evaluated statically on one release's sources (stdlib `ast`)
- names.py: what a name in a patched file refers to in one release's sources
- patched.py: the patched files check-upstream binds (the pristine file transformed as apply would)
- binding.py: the patched files' calls bound, statically, against a release's sources
- deps.py: the transformers and torch releases each vLLM release allows, bound against too
- connectors.py: the speculators 0.5+ path: hs-connectors' KV connector modules bound per vLLM release
- nightly.py: nightly version strings the index does not serve (selection only)
- release_rows.py: the release matrix's recorded rows (the user's own runs and release_record.json,
  generated) and whether a row is current for today's patches
- row_keys.py: a row's key, the digest of what it ran (the patch modules' code, the shared helpers
  they import, the recipe)
"""
