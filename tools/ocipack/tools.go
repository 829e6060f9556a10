//go:build tools

// Pins crane (the registry CLI of the same module) so `go build` can build it from this go.mod;
// docs/images.md uses it to push the archives to a registry.
package main

import _ "github.com/google/go-containerregistry/cmd/crane"
