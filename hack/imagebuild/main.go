// Command imagebuild builds the agent's multi-architecture OCI image
// without Docker (package ociimage) and pushes it. make image and make
// image-push run it:
//
//	imagebuild build -out DIR -version V -revision COMMIT -source URL -platform ARCH=ROOTFS,BINDIR ...
//	imagebuild push -layout DIR -ref REGISTRY/REPOSITORY:TAG
//
// build prints the index digest; push writes the index and every image
// in it to the registry (credentials from the Docker config, as docker
// login and crane leave them).
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/ambient-cni/ambient-cni/hack/imagebuild/ociimage"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "imagebuild:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) == 0 {
		return errors.New("usage: imagebuild build|push [flags]")
	}
	fs := flag.NewFlagSet("imagebuild "+args[0], flag.ContinueOnError)
	switch args[0] {
	case "build":
		var s ociimage.Spec
		out := fs.String("out", "", "OCI layout directory to write (replaced)")
		fs.StringVar(&s.Version, "version", "", "version (label and the index's name in the layout)")
		fs.StringVar(&s.Revision, "revision", "", "git commit (label)")
		fs.StringVar(&s.Source, "source", "", "source repository URL (label)")
		fs.Func("platform", "ARCH=ROOTFS,BINDIR: an architecture's base rootfs tarball and binaries (repeat)", func(v string) error {
			arch, rest, ok1 := strings.Cut(v, "=")
			rootfs, bin, ok2 := strings.Cut(rest, ",")
			if !ok1 || !ok2 || arch == "" || rootfs == "" || bin == "" {
				return errors.New("want ARCH=ROOTFS,BINDIR")
			}
			s.Platforms = append(s.Platforms, ociimage.Platform{Arch: arch, Rootfs: rootfs, BinDir: bin})
			return nil
		})
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		if *out == "" {
			return errors.New("build: -out is required")
		}
		idx, err := ociimage.Build(s)
		if err != nil {
			return err
		}
		if err := ociimage.WriteLayout(*out, idx, s.Version); err != nil {
			return fmt.Errorf("write %s: %w", *out, err)
		}
		d, err := idx.Digest()
		if err != nil {
			return err
		}
		fmt.Printf("wrote %s (OCI layout, index %s)\n", *out, d)
		return nil
	case "push":
		dir := fs.String("layout", "", "OCI layout directory written by build")
		ref := fs.String("ref", "", "where to push: REGISTRY/REPOSITORY:TAG")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		r, err := name.ParseReference(*ref)
		if err != nil {
			return fmt.Errorf("push: -ref: %w", err)
		}
		d, err := ociimage.Push(*dir, r, remote.WithAuthFromKeychain(authn.DefaultKeychain))
		if err != nil {
			return err
		}
		fmt.Printf("pushed %s@%s\n", r.Context(), d)
		return nil
	}
	return fmt.Errorf("unknown command %q (build, push)", args[0])
}
