"""Select and plan, with packaging's PEP 440 and the codemods: which patches and edits hold
for the versions a target has (selection), and the plan itself (planning), both over the
standard-library core in patcher/core/ that a bundle embeds as text."""
