"""A tool-using task for agents as code: look a code up with a tool, answer it (`hooks`, `data`)."""
