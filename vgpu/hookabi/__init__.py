"""The hook's binary ABI: the region and grant layouts shared with native/hook.

The C header native/hook/region_layout.h is generated from them.
"""
