"""The node floor: what the device plugin, the DRA plugin and the node monitor all stand on."""
