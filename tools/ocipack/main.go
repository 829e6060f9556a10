// Command ocipack writes a container image as a docker-archive tarball from layer tarballs and
// an image configuration given on the command line, with no container engine or registry.
// tools/images.sh calls it; tools/build.sh builds it from Go modules (the `ocipack` piece).
//
//	ocipack -ref docker.io/vgpu/x:dev -o x.tar -info x.json -layer base.tar.gz -layer app.tar \
//	    -entrypoint '["vgpu"]' -cmd '["--help"]' -env PATH=/bin -user 0:0 -label k=v
//
// A layer file may be a plain or a gzip-compressed tar; a plain one is compressed here. The
// archive names the image by -ref in manifest.json's RepoTags, which `ctr images import` uses
// as the image's name (no --index-name needed).
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

// info is what tools/images.sh records in images.json.
type info struct {
	Ref           string   `json:"ref"`
	Digest        string   `json:"digest"`
	ConfigDigest  string   `json:"config_digest"`
	Layers        int      `json:"layers"`
	LayerDigests  []string `json:"layer_digests"`
	UnpackedBytes int64    `json:"unpacked_bytes"`
}

func main() {
	var layers, env, labels list
	ref := flag.String("ref", "", "image reference written into the archive (required)")
	out := flag.String("o", "", "output docker-archive tarball (required)")
	infoPath := flag.String("info", "", "write a JSON summary here")
	entrypoint := flag.String("entrypoint", "", "entrypoint as a JSON array")
	cmd := flag.String("cmd", "", "cmd as a JSON array")
	user := flag.String("user", "", "user[:group]")
	workdir := flag.String("workdir", "", "working directory")
	arch := flag.String("arch", runtime.GOARCH, "architecture of the image")
	created := flag.String("created", "", "creation time, RFC 3339 (default: the Unix epoch, for reproducible configs)")
	flag.Var(&layers, "layer", "layer tarball, plain or gzip (repeatable, bottom first)")
	flag.Var(&env, "env", "NAME=value (repeatable)")
	flag.Var(&labels, "label", "key=value (repeatable)")
	flag.Parse()
	if *ref == "" || *out == "" || len(layers) == 0 {
		fail(fmt.Errorf("-ref, -o and at least one -layer are required"))
	}
	if err := run(*ref, *out, *infoPath, layers, env, labels, *entrypoint, *cmd, *user, *workdir, *arch, *created); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "ocipack: %v\n", err)
	os.Exit(1)
}

func jsonList(s string) ([]string, error) {
	if s == "" {
		return nil, nil
	}
	var v []string
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		return nil, fmt.Errorf("%q is not a JSON array of strings: %w", s, err)
	}
	return v, nil
}

func run(ref, out, infoPath string, layerFiles, env, labels []string, entrypoint, cmd, user, workdir, arch, created string) error {
	tag, err := name.NewTag(ref)
	if err != nil {
		return fmt.Errorf("reference %q: %w", ref, err)
	}
	img := empty.Image
	var unpacked int64
	for _, f := range layerFiles {
		l, err := tarball.LayerFromFile(f)
		if err != nil {
			return fmt.Errorf("layer %s: %w", f, err)
		}
		n, err := uncompressedSize(l)
		if err != nil {
			return fmt.Errorf("layer %s: %w", f, err)
		}
		unpacked += n
		img, err = mutate.Append(img, mutate.Addendum{
			Layer:   l,
			History: v1.History{CreatedBy: "tools/images.sh: " + baseName(f)},
		})
		if err != nil {
			return fmt.Errorf("layer %s: %w", f, err)
		}
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	cf.OS = "linux"
	cf.Architecture = arch
	if cf.Config.Entrypoint, err = jsonList(entrypoint); err != nil {
		return fmt.Errorf("-entrypoint: %w", err)
	}
	if cf.Config.Cmd, err = jsonList(cmd); err != nil {
		return fmt.Errorf("-cmd: %w", err)
	}
	cf.Config.Env = env
	cf.Config.User = user
	cf.Config.WorkingDir = workdir
	if len(labels) > 0 {
		cf.Config.Labels = map[string]string{}
		for _, kv := range labels {
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				return fmt.Errorf("-label %q: want key=value", kv)
			}
			cf.Config.Labels[k] = v
		}
	}
	when := time.Unix(0, 0).UTC()
	if created != "" {
		if when, err = time.Parse(time.RFC3339, created); err != nil {
			return fmt.Errorf("-created: %w", err)
		}
	}
	cf.Created = v1.Time{Time: when}
	for i := range cf.History {
		cf.History[i].Created = v1.Time{Time: when}
	}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return err
	}
	tmp := out + ".tmp"
	if err := tarball.WriteToFile(tmp, tag, img); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("writing %s: %w", out, err)
	}
	if err := os.Rename(tmp, out); err != nil {
		return err
	}
	if infoPath == "" {
		return nil
	}
	return writeInfo(infoPath, ref, img, unpacked)
}

func writeInfo(path, ref string, img v1.Image, unpacked int64) error {
	d, err := img.Digest()
	if err != nil {
		return err
	}
	cd, err := img.ConfigName()
	if err != nil {
		return err
	}
	ls, err := img.Layers()
	if err != nil {
		return err
	}
	in := info{Ref: ref, Digest: d.String(), ConfigDigest: cd.String(), Layers: len(ls), UnpackedBytes: unpacked}
	for _, l := range ls {
		ld, err := l.Digest()
		if err != nil {
			return err
		}
		in.LayerDigests = append(in.LayerDigests, ld.String())
	}
	b, err := json.MarshalIndent(in, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// uncompressedSize is the size of the layer's tar stream: what unpacking it writes, near enough.
func uncompressedSize(l v1.Layer) (int64, error) {
	rc, err := l.Uncompressed()
	if err != nil {
		return 0, err
	}
	defer rc.Close()
	return io.Copy(io.Discard, rc)
}

func baseName(p string) string {
	if i := strings.LastIndex(p, "/"); i >= 0 {
		return p[i+1:]
	}
	return p
}
