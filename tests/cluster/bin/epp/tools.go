//go:build tools

// Package tools names the command this module builds, so that go mod tidy keeps its dependencies.
package tools

import _ "sigs.k8s.io/gateway-api-inference-extension/cmd/epp"
