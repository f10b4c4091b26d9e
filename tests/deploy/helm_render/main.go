// helm-render renders a Helm chart the way `helm template` does, for the chart tests on machines
// without a helm binary. It is Go text/template with the sprig function library (Helm's own
// template engine) plus the functions and objects Helm adds on top and that Tandem's chart uses:
// include, tpl, required, toYaml, fromYaml, toJson, fromJson, lookup, .Values (values.yaml with
// each -f file merged over it; a null deletes a key), .Release, .Chart (from Chart.yaml),
// .Capabilities, .Template and .Files (Get, Glob, AsConfig, AsSecrets, Lines). Sprig brings the
// crypto functions charts use to make secrets (genCA, genSignedCert, randAlphaNum, b64enc).
//
// lookup answers from the objects of --lookup FILE (a YAML stream: the cluster as an upgrade
// would find it), or with nothing, as `helm template` and a first install do. With --lookup,
// .Release.IsUpgrade is true.
//
// Usage: helm-render [--notes] [-n NAMESPACE] [-f VALUES.yaml]... [--lookup OBJECTS.yaml]
//
//	RELEASE CHART_DIR
//
// Manifests go to stdout as a YAML stream, each preceded by "# Source: CHART/templates/FILE";
// templates whose output is blank are left out, partials (_*.tpl and friends) are never emitted
// and NOTES.txt is rendered only with --notes (then alone). Errors go to stderr with exit 1.
// values.schema.json is not checked here: tests/deploy/test_chart.py checks the merged values against
// it, as helm does. Subcharts are not supported (the chart has none).
//
// Build (GOPATH mode, Debian's packages; tests/deploy/helm_render/install_deps.sh installs them):
//
//	GO111MODULE=off GOPATH=/usr/share/gocode CGO_ENABLED=0 go build -o helm-render .
package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	"github.com/ghodss/yaml"
)

const maxIncludeDepth = 1000

var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

type valueFiles []string

func (v *valueFiles) String() string     { return strings.Join(*v, ",") }
func (v *valueFiles) Set(s string) error { *v = append(*v, s); return nil }

// Files is the chart's non-template files, as Helm's .Files.
type Files map[string][]byte

// Get returns a file's content ("" when absent).
func (f Files) Get(name string) string { return string(f[name]) }

// GetBytes returns a file's content as bytes.
func (f Files) GetBytes(name string) []byte { return f[name] }

// Glob returns the files whose chart-relative path matches pattern (see globMatch).
func (f Files) Glob(pattern string) Files {
	out := Files{}
	for name, data := range f {
		if globMatch(pattern, name) {
			out[name] = data
		}
	}
	return out
}

// AsConfig renders the files as a ConfigMap data block: base name -> content, as YAML.
func (f Files) AsConfig() string {
	if len(f) == 0 {
		return ""
	}
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = string(data)
	}
	return toYAML(m)
}

// AsSecrets renders the files as a Secret data block: base name -> base64 content.
func (f Files) AsSecrets() string {
	if len(f) == 0 {
		return ""
	}
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = base64.StdEncoding.EncodeToString(data)
	}
	return toYAML(m)
}

// Lines returns a file's lines.
func (f Files) Lines(name string) []string {
	s := string(f[name])
	if s == "" {
		return []string{}
	}
	return strings.Split(strings.TrimSuffix(s, "\n"), "\n")
}

// globMatch matches a chart-relative path as Helm's .Files.Glob does: "*" and "?" stay within
// one folder, "**" crosses folders, "{a,b}" is either, "[...]" is a character class.
func globMatch(pattern, name string) bool {
	var re strings.Builder
	re.WriteString("^")
	braces := 0
	for i := 0; i < len(pattern); i++ {
		c := pattern[i]
		switch {
		case c == '*' && i+1 < len(pattern) && pattern[i+1] == '*':
			re.WriteString(".*")
			i++
		case c == '*':
			re.WriteString("[^/]*")
		case c == '?':
			re.WriteString("[^/]")
		case c == '{':
			re.WriteString("(?:")
			braces++
		case c == '}' && braces > 0:
			re.WriteString(")")
			braces--
		case c == ',' && braces > 0:
			re.WriteString("|")
		case c == '[':
			j := strings.IndexByte(pattern[i:], ']')
			if j < 0 {
				re.WriteString(regexp.QuoteMeta(pattern[i:]))
				i = len(pattern)
				continue
			}
			class := pattern[i+1 : i+j]
			if strings.HasPrefix(class, "!") {
				class = "^" + class[1:]
			}
			re.WriteString("[" + class + "]")
			i += j
		default:
			re.WriteString(regexp.QuoteMeta(string(c)))
		}
	}
	re.WriteString("$")
	ok, err := regexp.MatchString(re.String(), name)
	return err == nil && ok
}

// mergeValues merges src over dst (Helm's coalescing of user values over chart defaults): maps
// merge key by key, anything else replaces, and a null in src deletes the key.
func mergeValues(dst, src map[string]interface{}) map[string]interface{} {
	for k, sv := range src {
		if sv == nil {
			delete(dst, k)
			continue
		}
		sm, sIsMap := sv.(map[string]interface{})
		dm, dIsMap := dst[k].(map[string]interface{})
		if sIsMap && dIsMap {
			dst[k] = mergeValues(dm, sm)
		} else {
			dst[k] = sv
		}
	}
	return dst
}

func readYAMLMap(file string) (map[string]interface{}, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	m := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	if m == nil {
		m = map[string]interface{}{}
	}
	return m, nil
}

func toYAML(v interface{}) string {
	out, err := yaml.Marshal(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(out), "\n")
}

func fromYAML(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := yaml.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func toJSON(v interface{}) string {
	out, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(out)
}

func fromJSON(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

// apiVersions is .Capabilities.APIVersions: `helm template` without a cluster knows none beyond
// the built-in ones, and the chart asks for none.
type apiVersions []string

// Has reports whether an API version (or version/Kind) is known.
func (a apiVersions) Has(v string) bool {
	for _, x := range a {
		if x == v {
			return true
		}
	}
	return false
}

// renderer holds one chart's parsed templates.
type renderer struct {
	tmpl         *template.Template
	includeDepth int
	cluster      []map[string]interface{} // what lookup finds (--lookup)
}

// lookup is Helm's: the object of that apiVersion, kind, namespace and name, or with an empty
// name a list of every such object; an empty map when there is none.
func (r *renderer) lookup(apiVersion, kind, namespace, name string) (map[string]interface{}, error) {
	var items []interface{}
	for _, obj := range r.cluster {
		meta, _ := obj["metadata"].(map[string]interface{})
		if obj["apiVersion"] != apiVersion || obj["kind"] != kind || meta == nil {
			continue
		}
		if namespace != "" && meta["namespace"] != namespace {
			continue
		}
		if name == "" {
			items = append(items, obj)
		} else if meta["name"] == name {
			return obj, nil
		}
	}
	if name == "" && items != nil {
		return map[string]interface{}{"apiVersion": apiVersion, "kind": kind + "List", "items": items}, nil
	}
	return map[string]interface{}{}, nil
}

// readObjects reads a YAML stream of Kubernetes objects (documents separated by "---").
func readObjects(file string) ([]map[string]interface{}, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var objects []map[string]interface{}
	for _, doc := range docSeparator.Split(string(data), -1) {
		if strings.TrimSpace(doc) == "" {
			continue
		}
		obj := map[string]interface{}{}
		if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		if len(obj) > 0 {
			objects = append(objects, obj)
		}
	}
	return objects, nil
}

func (r *renderer) funcs() template.FuncMap {
	f := sprig.TxtFuncMap()
	// Helm drops these two: a chart must not read the renderer's environment.
	delete(f, "env")
	delete(f, "expandenv")
	f["toYaml"] = toYAML
	f["fromYaml"] = fromYAML
	f["toJson"] = toJSON
	f["fromJson"] = fromJSON
	f["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil {
			return nil, errors.New(msg)
		}
		if s, ok := v.(string); ok && s == "" {
			return nil, errors.New(msg)
		}
		return v, nil
	}
	f["include"] = func(name string, data interface{}) (string, error) {
		if r.includeDepth >= maxIncludeDepth {
			return "", fmt.Errorf("include %q: nested too deep", name)
		}
		r.includeDepth++
		defer func() { r.includeDepth-- }()
		var buf bytes.Buffer
		if err := r.tmpl.ExecuteTemplate(&buf, name, data); err != nil {
			return "", err
		}
		return buf.String(), nil
	}
	f["tpl"] = func(text string, data interface{}) (string, error) {
		clone, err := r.tmpl.Clone()
		if err != nil {
			return "", err
		}
		t, err := clone.New("tpl").Parse(text)
		if err != nil {
			return "", fmt.Errorf("tpl: %w", err)
		}
		var buf bytes.Buffer
		if err := t.Execute(&buf, data); err != nil {
			return "", fmt.Errorf("tpl: %w", err)
		}
		return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
	}
	f["lookup"] = r.lookup
	return f
}

type options struct {
	release   string
	namespace string
	chartDir  string
	values    valueFiles
	notes     bool
	lookup    string
}

func run(o options) (string, error) {
	chartMeta, err := readYAMLMap(filepath.Join(o.chartDir, "Chart.yaml"))
	if err != nil {
		return "", err
	}
	chartName, _ := chartMeta["name"].(string)
	if chartName == "" {
		return "", errors.New("Chart.yaml has no name")
	}
	values, err := readYAMLMap(filepath.Join(o.chartDir, "values.yaml"))
	if err != nil {
		return "", err
	}
	for _, file := range o.values {
		user, err := readYAMLMap(file)
		if err != nil {
			return "", err
		}
		values = mergeValues(values, user)
	}

	// Chart files and templates, by chart-relative slash path.
	files := Files{}
	var templates []string
	templateText := map[string]string{}
	err = filepath.Walk(o.chartDir, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if info.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(o.chartDir, p)
		rel = filepath.ToSlash(rel)
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		switch {
		case strings.HasPrefix(rel, "templates/"):
			templates = append(templates, rel)
			templateText[rel] = string(data)
		case rel == "Chart.yaml" || rel == "values.yaml" || rel == "values.schema.json":
		case strings.HasPrefix(rel, "charts/"):
			return fmt.Errorf("%s: subcharts are not supported by this renderer", rel)
		default:
			files[rel] = data
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	sort.Strings(templates)

	r := &renderer{}
	if o.lookup != "" {
		if r.cluster, err = readObjects(o.lookup); err != nil {
			return "", err
		}
	}
	r.tmpl = template.New(chartName)
	r.tmpl.Funcs(r.funcs())
	for _, rel := range templates {
		name := chartName + "/" + rel
		if _, err := r.tmpl.New(name).Parse(templateText[rel]); err != nil {
			return "", err
		}
	}

	chart := map[string]interface{}{}
	for k, v := range chartMeta {
		// Helm exposes Chart.yaml fields capitalized: name -> .Chart.Name.
		chart[strings.ToUpper(k[:1])+k[1:]] = v
	}
	top := map[string]interface{}{
		"Values": values,
		"Chart":  chart,
		"Release": map[string]interface{}{
			"Name": o.release, "Namespace": o.namespace, "Service": "Helm",
			"IsInstall": o.lookup == "", "IsUpgrade": o.lookup != "", "Revision": 1,
		},
		"Capabilities": map[string]interface{}{
			"KubeVersion": map[string]interface{}{
				"Version": "v1.30.0", "Major": "1", "Minor": "30", "GitVersion": "v1.30.0",
			},
			"APIVersions": apiVersions{},
		},
		"Files": files,
	}

	var out strings.Builder
	for _, rel := range templates {
		base := path.Base(rel)
		isNotes := base == "NOTES.txt"
		if strings.HasPrefix(base, "_") || isNotes != o.notes {
			continue
		}
		name := chartName + "/" + rel
		data := map[string]interface{}{}
		for k, v := range top {
			data[k] = v
		}
		data["Template"] = map[string]interface{}{
			"Name": name, "BasePath": chartName + "/templates",
		}
		var buf bytes.Buffer
		if err := r.tmpl.ExecuteTemplate(&buf, name, data); err != nil {
			return "", err
		}
		text := strings.ReplaceAll(buf.String(), "<no value>", "")
		if strings.TrimSpace(text) == "" {
			continue
		}
		if isNotes {
			out.WriteString(text)
			continue
		}
		// One document per "---", each under its template's Source line, as Helm prints them.
		for _, doc := range docSeparator.Split(text, -1) {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			out.WriteString("---\n# Source: " + name + "\n")
			out.WriteString(strings.Trim(doc, "\n") + "\n")
		}
	}
	return out.String(), nil
}

func main() {
	var o options
	fs := flag.NewFlagSet("helm-render", flag.ExitOnError)
	fs.Var(&o.values, "f", "values file merged over the chart's values.yaml (repeatable)")
	fs.StringVar(&o.namespace, "n", "default", "release namespace")
	fs.BoolVar(&o.notes, "notes", false, "render NOTES.txt only")
	fs.StringVar(&o.lookup, "lookup", "", "YAML stream of the objects lookup finds (an upgrade)")
	fs.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: helm-render [--notes] [-n NAMESPACE] [-f VALUES]... [--lookup OBJECTS] RELEASE CHART_DIR")
		fs.PrintDefaults()
	}
	_ = fs.Parse(os.Args[1:])
	if fs.NArg() != 2 {
		fs.Usage()
		os.Exit(2)
	}
	o.release, o.chartDir = fs.Arg(0), fs.Arg(1)
	out, err := run(o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
	fmt.Print(out)
}
