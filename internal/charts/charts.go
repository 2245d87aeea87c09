// Package charts draws the pictures `make demo` and `make bench` write next to their text
// reports: line and point charts of named series, drawn by gonum.org/v1/plot as SVG a browser
// opens. The callers build a Chart from their report's own numbers (the same values the text
// prints), so a test can compare the plotted series with the report.
package charts

import (
	"bytes"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// Point is one value of a series.
type Point struct{ X, Y float64 }

// Series is one named line (or set of points) of a chart.
type Series struct {
	Name   string
	Points []Point
	// Dots draws the points alone, without a line between them.
	Dots bool
	// Dashed draws the line dashed (a second measure of the same thing, such as in use beside
	// held); Color, when set, picks the colour of another series (its index), so the two pair up.
	Dashed bool
	Color  int
}

// Chart is one picture: a title, the axes' labels and the series.
type Chart struct {
	// File is the name the chart is written under (e.g. "cni-latency.svg").
	File           string
	Title          string
	XLabel, YLabel string
	Series         []Series
	// LogX puts the X axis on a logarithmic scale (a latency distribution with a long tail).
	LogX bool
}

// Size of every chart, in points (a browser shows 1 pt as 1.33 px).
const (
	width  = 7.5 * vg.Inch
	height = 4.5 * vg.Inch
)

// WriteSVG draws c as one SVG document.
func (c Chart) WriteSVG(w io.Writer) error { return c.write(w, "svg") }

// write draws c in format (svg; png for a look at it in a test).
func (c Chart) write(w io.Writer, format string) error {
	p := plot.New()
	p.Title.Text = c.Title
	p.X.Label.Text = c.XLabel
	p.Y.Label.Text = c.YLabel
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	for i, s := range c.Series {
		xys := make(plotter.XYs, len(s.Points))
		for j, pt := range s.Points {
			xys[j] = plotter.XY{X: pt.X, Y: pt.Y}
		}
		col := plotutil.Color(i)
		if s.Color > 0 || s.Dashed {
			col = plotutil.Color(s.Color)
		}
		if s.Dots {
			sc, err := plotter.NewScatter(xys)
			if err != nil {
				return fmt.Errorf("%s: %s: %w", c.Title, s.Name, err)
			}
			sc.GlyphStyle.Color = col
			sc.GlyphStyle.Radius = vg.Points(2)
			sc.GlyphStyle.Shape = draw.CircleGlyph{}
			p.Add(sc)
			p.Legend.Add(s.Name, sc)
			continue
		}
		l, err := plotter.NewLine(xys)
		if err != nil {
			return fmt.Errorf("%s: %s: %w", c.Title, s.Name, err)
		}
		l.LineStyle.Color = col
		l.LineStyle.Width = vg.Points(1.5)
		if s.Dashed {
			l.LineStyle.Dashes = []vg.Length{vg.Points(5), vg.Points(3)}
		}
		p.Add(l)
		p.Legend.Add(s.Name, l)
	}
	// Room above the highest value for the legend, which sits at the top.
	if p.Y.Max > p.Y.Min {
		p.Y.Max += 0.25 * (p.Y.Max - p.Y.Min)
	}
	p.X.Tick.Marker, p.Y.Tick.Marker = niceTicks{}, niceTicks{}
	if c.LogX && p.X.Min > 0 {
		p.X.Scale, p.X.Tick.Marker = plot.LogScale{}, logTicks{}
	}
	wt, err := p.WriterTo(width, height, format)
	if err != nil {
		return err
	}
	_, err = wt.WriteTo(w)
	return err
}

// ReportFile is the name of the text report beside the pictures.
const ReportFile = "report.txt"

// WriteReport writes a text report into dir as ReportFile and every chart beside it under its
// File name, and returns the paths written, the report first.
func WriteReport(dir, text string, cs []Chart) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	report := filepath.Join(dir, ReportFile)
	if err := os.WriteFile(report, []byte(text), 0o644); err != nil {
		return nil, err
	}
	paths := []string{report}
	for _, c := range cs {
		path := filepath.Join(dir, c.File)
		f, err := os.Create(path)
		if err != nil {
			return paths, err
		}
		err = c.WriteSVG(f)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return paths, fmt.Errorf("%s: %w", path, err)
		}
		paths = append(paths, path)
	}
	return paths, nil
}

// niceTicks labels an axis at about six round values (1, 2 or 5 times a power of ten), printed
// as short as they are (250, 0.5), with unlabelled minor ticks between.
type niceTicks struct{}

func (niceTicks) Ticks(lo, hi float64) []plot.Tick {
	if !(hi > lo) || math.IsInf(hi-lo, 0) {
		return []plot.Tick{{Value: lo, Label: label(lo)}}
	}
	raw := (hi - lo) / 6
	pow := math.Pow(10, math.Floor(math.Log10(raw)))
	step := 10 * pow
	for _, m := range []float64{1, 2, 5} {
		if m*pow >= raw {
			step = m * pow
			break
		}
	}
	var ticks []plot.Tick
	for v := math.Ceil(lo/step) * step; v <= hi+step*1e-9; v += step {
		ticks = append(ticks, plot.Tick{Value: v, Label: label(v)})
		if minor := v + step/2; minor < hi {
			ticks = append(ticks, plot.Tick{Value: minor})
		}
	}
	return ticks
}

// logTicks labels a logarithmic axis at 1, 2 and 5 times each power of ten in range.
type logTicks struct{}

func (logTicks) Ticks(lo, hi float64) []plot.Tick {
	var ticks []plot.Tick
	for pow := math.Pow(10, math.Floor(math.Log10(lo))); pow <= hi; pow *= 10 {
		for m := 1.0; m < 10; m++ {
			v := m * pow
			if v < lo || v > hi {
				continue
			}
			t := plot.Tick{Value: v}
			if m == 1 || m == 2 || m == 5 {
				t.Label = label(v)
			}
			ticks = append(ticks, t)
		}
	}
	return ticks
}

func label(v float64) string {
	if math.Abs(v) < 1e-12 {
		v = 0
	}
	return strconv.FormatFloat(math.Round(v*1e6)/1e6, 'f', -1, 64)
}

// CDF is the distribution of values as a series: each value (sorted) against the share of
// values at or below it, so the curve at 0.5 and 0.99 reads the p50 and p99.
func CDF(name string, sorted []float64) Series {
	s := Series{Name: name, Points: make([]Point, len(sorted))}
	for i, v := range sorted {
		s.Points[i] = Point{X: v, Y: float64(i+1) / float64(len(sorted))}
	}
	return s
}

// CheckReport says what is wrong, if anything, with what WriteReport left in dir for text and
// cs: ReportFile must hold text, and each chart's file must parse as SVG and show the chart's
// title and every series' name.
func CheckReport(dir, text string, cs []Chart) error {
	b, err := os.ReadFile(filepath.Join(dir, ReportFile))
	if err != nil {
		return err
	}
	if string(b) != text {
		return fmt.Errorf("%s holds\n%s\nnot the report\n%s", ReportFile, b, text)
	}
	for _, c := range cs {
		svg, err := os.ReadFile(filepath.Join(dir, c.File))
		if err != nil {
			return err
		}
		root, texts, err := Texts(svg)
		if err != nil {
			return fmt.Errorf("%s: %w", c.File, err)
		}
		if root != "svg" {
			return fmt.Errorf("%s: root element %q", c.File, root)
		}
		all := strings.Join(texts, "\n")
		for _, want := range append([]string{c.Title, c.XLabel, c.YLabel}, c.names()...) {
			if !strings.Contains(all, want) {
				return fmt.Errorf("%s shows no %q; its texts: %q", c.File, want, texts)
			}
		}
	}
	return nil
}

func (c Chart) names() []string {
	var out []string
	for _, s := range c.Series {
		out = append(out, s.Name)
	}
	return out
}

// Texts parses an SVG document and returns its root element's name and every text it shows
// (title, axis and tick labels, legend), for tests that check a picture says what its report
// says; an error if the document is not well-formed XML.
func Texts(svg []byte) (root string, texts []string, err error) {
	dec := xml.NewDecoder(bytes.NewReader(svg))
	depth, inText := 0, false
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return "", nil, fmt.Errorf("the SVG does not parse: %w", err)
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			if depth == 0 {
				root = tok.Name.Local
			}
			depth++
			inText = tok.Name.Local == "text"
		case xml.EndElement:
			depth--
			inText = false
		case xml.CharData:
			if s := strings.TrimSpace(string(tok)); inText && s != "" {
				texts = append(texts, s)
			}
		}
	}
	if depth != 0 || root == "" {
		return "", nil, fmt.Errorf("the SVG ends at depth %d, root %q", depth, root)
	}
	return root, texts, nil
}
