"""hookplug's first-party plugins, registered through the ``hookplug.plugins`` entry points."""
