package main

import (
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// The pages TestDocsNameRealCommands reads, relative to the repository root.
var docPages = []string{"README.md", "docs/*.md"}

// TestDocsNameRealCommands keeps the documentation true to the code: every `make TARGET` that
// README.md and docs/*.md name in code (a `code span`, an indented or fenced block) is a target of
// the Makefile, every `ipwarden SUBCOMMAND ... --flag` names a command and flags that command
// has, and every flag in the first column of a table under a heading that names an `ipwarden`
// command (docs/configuration.md's flag tables, docs/simulate.md's) is one of that command's.
// The flag sets are the ones main builds (newRootCommand), not a copy.
func TestDocsNameRealCommands(t *testing.T) {
	root := filepath.Join("..", "..")
	targets := makeTargets(t, filepath.Join(root, "Makefile"))
	cli := newRootCommand()
	var pages []string
	for _, g := range docPages {
		m, err := filepath.Glob(filepath.Join(root, g))
		if err != nil {
			t.Fatal(err)
		}
		pages = append(pages, m...)
	}
	if len(pages) < 2 {
		t.Fatalf("found only %v: run from cmd/ipwarden in the repository", pages)
	}
	checked, checks := 0, 0
	for _, page := range pages {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, page)
		for _, p := range docProblems(string(b), targets, cli, &checks) {
			t.Errorf("%s:%d: %s", rel, p.line, p.what)
		}
		checked++
	}
	t.Logf("checked %d names on %d pages against %d make targets and the ipwarden command tree", checks, checked, len(targets))
	// The pages name dozens of targets, commands and flags (the flag tables alone over 60): far
	// fewer means the patterns above stopped matching what the pages write.
	if checks < 100 {
		t.Errorf("only %d names checked: the checker no longer reads the pages' commands", checks)
	}
}

// TestREADMETestCommandIsCIs keeps the README's test command the one CI runs: the last command
// of .ci/run (after it installs what a fresh machine lacks) is the command README.md's table
// gives for the whole test suite.
func TestREADMETestCommandIsCIs(t *testing.T) {
	root := filepath.Join("..", "..")
	ci, err := os.ReadFile(filepath.Join(root, ".ci", "run"))
	if err != nil {
		t.Fatal(err)
	}
	last := ""
	for _, line := range strings.Split(string(ci), "\n") {
		if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "#") {
			last = l
		}
	}
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| the whole test suite[^|]*\\| `([^`]+)` \\|").FindSubmatch(readme)
	if row == nil {
		t.Fatal("README.md has no row \"the whole test suite\" with its command in its table")
	}
	if string(row[1]) != last {
		t.Errorf("README.md gives %q for the whole test suite; .ci/run runs %q", row[1], last)
	}
}

// TestDocProblems shows what the docs check catches and what it leaves alone.
func TestDocProblems(t *testing.T) {
	targets := map[string]bool{"test": true, "demo": true, "bench-scale": true}
	cli := newRootCommand()
	page := "# Title\n" +
		"Run `make test`, `sudo make demo DEMO_FLAGS=--keep` or `make bench-scale SCALE_NODES=10`; make sure to read on.\n" +
		"`an error message: make one pool`, `(make demo)`\n" +
		"`make nosuch` and `make VAR=1 gone`.\n" +
		"    ipwarden usage --nodes    # per node: --not-a-flag in a comment\n" +
		"    kubectl ipwarden who --kubeconfig k 10.0.0.1\n" +
		"    ipwarden agent handback --to '{}' --network pods [--dry-run] | less --raw\n" +
		"`ipwarden usage --nodez` and `ipwarden frobnicate` and `ipwarden-cni` and `ipwarden.io/pools`\n" +
		"    helm install ipwarden deploy/helm/ipwarden --set image.tag=TAG\n" +
		"```\n" +
		"ipwarden check --output=json --no-such\n" +
		"```\n" +
		"## `ipwarden agent`\n" +
		"| flag | default |\n|---|---|\n" +
		"| `--node-name` | x |\n| `--metrics-bind-address`, `--gone-flag` | y |\n" +
		"### More about the agent\n" +
		"| `--socket` | still the agent's |\n" +
		"## The CNI plugin\n" +
		"| `--anything` | no command here |\n"
	var got []string
	checks := 0
	for _, p := range docProblems(page, targets, cli, &checks) {
		got = append(got, p.what)
	}
	want := []string{
		`make target "nosuch" is not in the Makefile`,
		`make target "gone" is not in the Makefile`,
		`"ipwarden usage" has no flag --nodez`,
		`"ipwarden frobnicate": no such command`,
		`"ipwarden check" has no flag --no-such`,
		`"ipwarden agent" has no flag --gone-flag`,
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

type docProblem struct {
	line int
	what string
}

var (
	fence    = regexp.MustCompile("^\\s*```")
	codeSpan = regexp.MustCompile("`([^`]+)`")
	// make starts the code, or follows sudo, a shell separator or a parenthesis.
	makeCall   = regexp.MustCompile(`(?:^\s*|[;&|(]\s*|^\s*sudo\s+)make((?:\s+[A-Z_]+=\S*)*)\s+([a-z][a-z0-9-]*)`)
	heading    = regexp.MustCompile(`^(#+)\s+(.*)$`)
	headingCmd = regexp.MustCompile("`(?:kubectl )?ipwarden ([a-z][a-z ]*?)`")
	flagName   = regexp.MustCompile(`^\[?--([a-z0-9][a-z0-9-]*)`)
	word       = regexp.MustCompile(`^[a-z]+$`)
	// What may stand before "ipwarden" when it starts a command.
	commandStart = map[string]bool{"kubectl": true, "sudo": true, "$": true, "#": true, ";": true, "&&": true, "||": true, "|": true, "(": true}
)

// docProblems lists what one page names that the Makefile or the ipwarden command tree lacks.
// It counts in checks each make target, command and flag it looked at.
func docProblems(page string, targets map[string]bool, cli *cobra.Command, checks *int) []docProblem {
	var out []docProblem
	inFence := false
	var ctx *cobra.Command // the command the current section's flag tables describe
	ctxLevel := 0
	for i, line := range strings.Split(page, "\n") {
		n := i + 1
		if fence.MatchString(line) {
			inFence = !inFence
			continue
		}
		var code []string
		switch {
		case inFence:
			code = []string{line}
		case strings.HasPrefix(line, "    ") || strings.HasPrefix(line, "\t"):
			code = []string{line}
		default:
			for _, m := range codeSpan.FindAllStringSubmatch(line, -1) {
				code = append(code, m[1])
			}
		}
		if !inFence {
			if h := heading.FindStringSubmatch(line); h != nil {
				level := len(h[1])
				if m := headingCmd.FindStringSubmatch(h[2]); m != nil {
					if c, rest := findCommand(cli, strings.Fields(m[1])); len(rest) == 0 {
						ctx, ctxLevel = c, level
					}
				} else if ctx != nil && level <= ctxLevel {
					ctx = nil
				}
				continue
			}
			if ctx != nil && strings.HasPrefix(strings.TrimSpace(line), "|") {
				cells := strings.Split(strings.TrimSpace(line), "|")
				if len(cells) > 2 {
					for _, m := range codeSpan.FindAllStringSubmatch(cells[1], -1) {
						f := flagName.FindStringSubmatch(m[1])
						if f == nil {
							continue
						}
						*checks++
						if !hasFlag(ctx, f[1]) {
							out = append(out, docProblem{n, `"` + ctx.CommandPath() + `" has no flag --` + f[1]})
						}
					}
				}
			}
		}
		for _, c := range code {
			for _, m := range makeCall.FindAllStringSubmatch(c, -1) {
				*checks++
				if !targets[m[2]] {
					out = append(out, docProblem{n, `make target "` + m[2] + `" is not in the Makefile`})
				}
			}
			out = append(out, commandProblems(c, n, cli, checks)...)
		}
	}
	return out
}

// commandProblems checks each `ipwarden ...` command line in a piece of code: the subcommands
// exist and every --flag up to the end of the command (a comment, a pipe, a ;) is one of the
// command's.
func commandProblems(code string, n int, cli *cobra.Command, checks *int) []docProblem {
	var out []docProblem
	words := strings.Fields(code)
	for i := 0; i < len(words); i++ {
		if words[i] != "ipwarden" {
			continue
		}
		// "ipwarden" starts a command at the start of the code or after kubectl, sudo or a
		// shell separator; "helm install ipwarden deploy/..." names a release, not a command.
		if i > 0 && !commandStart[words[i-1]] {
			continue
		}
		var args []string
		for _, w := range words[i+1:] {
			if strings.HasPrefix(w, "#") || w == "|" || w == ";" || w == "&&" || w == "||" || strings.HasSuffix(w, ";") || w == ")" {
				break
			}
			args = append(args, w)
		}
		if len(args) == 0 || !word.MatchString(args[0]) {
			continue
		}
		c, rest := findCommand(cli, args)
		*checks++
		if c == cli {
			out = append(out, docProblem{n, `"ipwarden ` + args[0] + `": no such command`})
			continue
		}
		for _, a := range rest {
			f := flagName.FindStringSubmatch(a)
			if f == nil {
				continue
			}
			*checks++
			if !hasFlag(c, f[1]) {
				out = append(out, docProblem{n, `"` + c.CommandPath() + `" has no flag --` + f[1]})
			}
		}
	}
	return out
}

// findCommand walks the command tree down the leading words that name subcommands.
func findCommand(root *cobra.Command, words []string) (*cobra.Command, []string) {
	c := root
	for len(words) > 0 {
		var next *cobra.Command
		for _, s := range c.Commands() {
			if s.Name() == words[0] || s.HasAlias(words[0]) {
				next = s
			}
		}
		if next == nil {
			break
		}
		c, words = next, words[1:]
	}
	return c, words
}

func hasFlag(c *cobra.Command, name string) bool {
	if name == "help" {
		return true
	}
	return c.Flags().Lookup(name) != nil || c.InheritedFlags().Lookup(name) != nil
}

// makeTargets reads the targets a Makefile defines (rules and .PHONY names).
func makeTargets(t *testing.T, path string) map[string]bool {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	rule := regexp.MustCompile(`^([A-Za-z0-9_.$()/ -]+):([^=]|$)`)
	out := map[string]bool{}
	for _, line := range strings.Split(string(b), "\n") {
		m := rule.FindStringSubmatch(line)
		if m == nil || strings.HasPrefix(line, "\t") {
			continue
		}
		for _, name := range strings.Fields(m[1]) {
			out[name] = true
		}
		if strings.HasPrefix(line, ".PHONY:") {
			for _, name := range strings.Fields(strings.TrimPrefix(line, ".PHONY:")) {
				out[name] = true
			}
		}
	}
	names := make([]string, 0, len(out))
	for k := range out {
		names = append(names, k)
	}
	sort.Strings(names)
	if !out["test"] || !out["demo"] {
		t.Fatalf("read targets %v from %s: test and demo missing", names, path)
	}
	return out
}
